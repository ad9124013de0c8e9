"""Benchmarks behind `tierio bench <target>`: each module compares tierio with its peers and
the hardware limit (fio) in one run and returns one JSON object whose "ratios" hold the targets."""
