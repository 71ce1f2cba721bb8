"""NumPy references (oracles) of moe_rt's ops, one module per op family; also the CPU backend."""
