"""What every PlexRL process shares: the wire (messages, calls, frames, the client socket, keys),
job specs, sizes and memory plans, the state policy, errors and atomic writes.

Nothing here imports torch, vLLM, the daemon or the worker.
"""
