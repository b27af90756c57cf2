"""One-shot runs: a program in a fresh throwaway sandbox (no kernel), then nothing left behind.

    host.py     OneShotHost: where the tools' one-shot runs go (local.py here, a cluster's front door there)
    local.py    LocalOneShots: the runs of one process, on a SessionManager's leases and in its room
    runs.py     OneShotRunner: a run, a syntax check or the versions probe, each on a lease of its own
    program.py  what the sandbox runs (argv per language, inputs as files) and how its pipes are read
    slots.py    how many runs at once, and each client's share of them
    ready.py    sandboxes started ahead for the next run with the same options

A layer above sessions/: a run takes its sandbox on sessions' leases (leases.py), with sessions' options
and egress wiring; sessions/ knows nothing of one-shot runs, and counts the sandboxes started ahead in
its room only as IdleSandboxes (sessions/idle_room.py), which LocalOneShots hands the manager.
"""
