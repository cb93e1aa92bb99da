"""Speed, memory and accuracy benchmarks (run as scripts; never imported by library code)."""
