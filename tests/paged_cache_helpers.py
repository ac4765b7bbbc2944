"""Random paged KV caches for kernel and backend tests (shared by several test files)."""

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, strided=False):
    """A random [num_blocks, block_size, Hkv, D] cache; ``strided`` makes it non-contiguous."""
    pad = 8 if strided else 0  # a view of a wider tensor: exercises the explicit strides
    full = torch.randn(num_blocks, block_size, num_kv_heads, head_dim + pad, dtype=torch.float32)
    return full.to(dtype)[..., :head_dim]


def paged_setup(seq_lens, block_size, num_kv_heads, head_dim, dtype, poison=True, seed=0):
    """Random K/V caches and shuffled block tables holding sequences of ``seq_lens``.

    With ``poison`` every slot that belongs to no sequence (spare blocks, the tail of each last
    block) is NaN, so any read past a sequence's end shows up in the output.
    Returns (k_cache, v_cache, block_tables [B, max_blocks] int32, tables as lists).
    """
    torch.manual_seed(seed)
    blocks_needed = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # a few spare blocks that nobody owns
    perm = torch.randperm(num_blocks).tolist()  # physical blocks in random order
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(perm[used : used + n])
        used += n
    k_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, strided=True)
    v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    if poison:
        owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for table, s_len in zip(tables, seq_lens):
            for pos in range(s_len):
                owned[table[pos // block_size], pos % block_size] = True
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
    width = max(blocks_needed)
    # Padding entries point at block 0, a real block of some sequence: it must never be read.
    padded = [t + [0] * (width - len(t)) for t in tables]
    return k_cache, v_cache, torch.tensor(padded, dtype=torch.int32), tables
