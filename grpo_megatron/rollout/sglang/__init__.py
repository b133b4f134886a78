"""The SGLang rollout engine (SGLang 0.5.17 to 0.5.23, by capability; on GPUs, or SGLang's CPU engine
for a CPU job). Importing the package imports no SGLang. Its rooms, one module each, each with its
state named, so that partial rollouts, engine restarts or per-call costs change one room:

- engine, ``engine.py``: ``SGLangEngine``: generate, submit, score, weights, memory, health, restart,
  shutdown;
- watch, ``watch.py``: how a wait is watched: ``ServerGuard`` (the servers behind the one generation in
  flight), ``SchedulerProbe`` (a hung scheduler); a lost engine stopped (``stop_lost_part``);
- launch, ``launch.py``: how an engine starts: server arguments, environment, ``launch_servers`` (the
  servers and weight transport by mode, decided once);
- layout, ``layout.py``: which ranks form an engine, where the parts of one across nodes meet;
- model config, ``model_config.py``: the config.json SGLang reads (quantization removed, DeepSeek-V3's
  published fields);
- CPU path, ``cpu_path.py``: which of SGLang's CPU paths an engine takes (intel_amx, torch_native);
- protocol, ``protocol.py``: requests (sampling, scoring, routes) and their outputs decoded (pure);
- weights, ``weights.py``: the load protocol (``WeightLoad``: version, sessions, staleness), checks,
  the tied head, ``WeightTransport``;
- transports, ``ipc.py`` and ``nccl.py``: colocated CUDA IPC / disaggregated NCCL broadcast, the
  modes' differences;
- member, ``member.py``: the other GPUs of a colocated engine (``SGLangSyncMember``), a further node's
  part (``NodePart``);
- shards, ``shards.py``: what each engine GPU loads (its EP rank's experts);
- health, ``health.py``: the engine's processes watched; a lost one named (``EngineLost``);
- compat, ``compat.py``: the adjustments real SGLang needs on this machine, by capability.
"""
