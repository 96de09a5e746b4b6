"""Layer 3, the training loop and what it stands on: optimiser, checkpoints and their integrity,
the non-finite watch, preemption, the watchdog, the workdir lock, meshes and partition rules, data
parallelism, metrics. It is handed a task (``attnjax.tasks``) and never names one."""
