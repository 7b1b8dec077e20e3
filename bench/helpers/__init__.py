"""What the benchmarks and the tests share (joining the group and writing results, memory
and wire meters), and the tools that are not benchmarks: the cost model's calibration, the
GPU tier's summary and the version matrix."""
