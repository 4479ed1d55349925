"""Record batches (design.md section 4): pure functions over bytes, no I/O."""
