"""Test and benchmark harness: simulated inference clusters, traces, workloads, the replayer."""
