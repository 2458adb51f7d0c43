"""Scale by simulation (issue 17): simulated GPUs against the real brokers, controller and sample store.

- timing.py  — the ONE file of named timing models and completion-length distributions, with their sources
- config.py  — `rollout.engine.sim` and `trainer.sim` config sections
- des.py     — a zero-infrastructure discrete-event model of the same engine and admission rule (the
               simulator's own correctness test compares it with the closed form)

The simulated engine is areal_mq/sim/engine.py (`rollout.engine.kind: sim`); the swarm process that
hosts many simulated rollout workers is workers/swarm.py; the simulated trainer is workers/sim_trainer.py.
"""
