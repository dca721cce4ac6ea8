"""The Slurm pool backend: each kernel a Slurm job with a GRES shard or GPU request.

:mod:`.pool` (:class:`~jupyter_gpupool.backends.slurm.pool.SlurmPool`) and :mod:`.commands`
(``sbatch``, ``squeue``, ``scontrol`` and what they print). See docs/hpc.md.
"""
