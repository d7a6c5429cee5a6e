"""Discrete-event simulator: the real router policy and the engine's real scheduler and block
manager on simulated GPUs (``thinkserve sim``). See docs/simulator.md."""
