"""Training: the typed config (``config``), the launcher's variables (``launch_env``), process groups and their time
budgets (``dist``; DeepSpeed's CPU comm op and its shared memory: ``deepspeed_cpu``), the files kept at the top of
``run_dir`` (``run_files``), engines (``parallel``: DeepSpeed ZeRO, FSDP2, plain/DDP, context parallelism),
optimizer and schedule (``optim``), checkpoints (``checkpoint``), what is
checked before any work (``preflight``, ``inputs``), run metrics, MFU and the run log (``metrics``; the FLOPs per
token are ``model.flops``), injected faults (``faults``), the loop (``trainer``) with everything around the step
as ``callbacks``, and the export of a checkpoint into a model folder (``export``).

May import ``pipeline.data``, ``pipeline.hf`` and ``pipeline.evaluation`` (the extrapolation callback runs a
passkey probe), besides ``model``, ``kernels`` and ``data_prep``.
"""
