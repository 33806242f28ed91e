from mlperf_tpu.cli import main

main()
