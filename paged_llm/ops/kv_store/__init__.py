"""Write this step's new K/V into their paged slots (Triton; the torch reference is
attention/torch_backend.py's store_kv_reference)."""
