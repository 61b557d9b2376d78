"""A trainer's job states and the tiers they move between: device, host memory, node-local NVMe.

``store`` (``StateStore``) decides where each job's state lives and moves it, keeping at most
``device_slots`` jobs in the trainer; ``job_copy`` holds a state off the device (``JobStateCopy``,
``BufferPool``); ``arena`` is the one host-memory block (pinned on CUDA) copies live in; ``files``
writes and reads a copy on NVMe (checksummed, written in place over a spare file); ``dirs`` owns a
trainer's NVMe directory (copies, spares, the bytes it may take). A state moved down and back is
the same bits; what to place where is decided by ``plexctl.common.state_policy``.
"""
