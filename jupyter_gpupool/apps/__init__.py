"""The command-line applications: ``jupyter gpupool`` (:mod:`.cli`) and its subcommands, the
simulator with its workload model (:mod:`.simulate`, :mod:`.workload`), the demo
(:mod:`.demo`), the kernelspec installer (:mod:`.kernelspec`) and the TLJH plugin (:mod:`.tljh`).
"""
