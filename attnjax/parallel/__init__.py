"""Layer 2, how a run spreads over devices and processes: meshes and partition rules
(``sharding``: the data, fsdp and model axes, the models' logical axis names laid out by one
table), the state and batches placed on them (``data_parallel``), several processes started on one
machine (``launch``), a checkpoint resumed on another process count (``elastic``), and the bound on
each step that ends a stalled process (``watchdog``). It knows no task and no training loop."""
