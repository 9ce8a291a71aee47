"""The `cute-ep` command (`cli`) and what it runs: the demo layer (`demo`), the benchmark
(`bench`), and the one-process-per-GPU launcher they and the multi-GPU tests share (`spawn`)."""
