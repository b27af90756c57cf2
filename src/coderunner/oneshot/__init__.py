"""One-shot runs: a program in a fresh throwaway sandbox (no kernel), then nothing left behind.

    runs.py     OneShotRunner: a run, a syntax check or the versions probe, each on a lease of its own
    program.py  what the sandbox runs (argv per language, inputs as files) and how its pipes are read
    slots.py    how many runs at once, and each client's share of them
    ready.py    sandboxes started ahead for the next run with the same options

It shares sessions/' layer: a run takes its sandbox on sessions' leases (leases.py), with sessions'
options and egress wiring, and the SessionManager holds a runner (OneShotRunner.for_settings), grants
its sandboxes started ahead room beside the sessions, and answers the SessionHost's one-shot calls
through it.
"""
