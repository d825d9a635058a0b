"""What checks an engine from outside, for our tests, the GPU check and a user's own tests: models
built in code with random weights (`models`), transformers' own decoding as the oracle and as the
peer of the benchmarks (`models`, `peers`), and the seeded soak driver (`soak`). Nothing here
downloads anything."""
