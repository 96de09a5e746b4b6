"""Layer 3, the training loop and what it stands on: optimiser, checkpoints and their integrity,
the non-finite watch, preemption, the workdir lock, metrics. It lays the run out over devices
with ``attnjax.parallel``, is handed a task (``attnjax.tasks``) and never names one."""
