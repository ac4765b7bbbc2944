"""Write this step's new K/V into their paged slots."""
