"""Plain ``nn.Module`` models used by the examples, tests and benchmarks (they know nothing of fz3)."""
