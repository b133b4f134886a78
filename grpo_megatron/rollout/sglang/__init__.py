"""The SGLang rollout engine: the adapter (``engine.py``), one module per weight transport (``ipc.py``
colocated CUDA IPC, ``nccl.py`` disaggregated NCCL, behind ``weights.py``), what each engine GPU
loads (``shards.py``), and the adjustments real SGLang needs on this machine (``compat.py``).
Importing the package imports no SGLang."""
