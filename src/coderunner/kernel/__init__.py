"""One kernel in a sandbox, spoken to by the host's own bounded channels.

incarnation.py     Kernel: one incarnation, a process and its client started and ended together
process.py         KernelProcess: the sandbox, its connection info; start, checkpoint, restore, kill
client.py          KernelClient: channels to it, its welcome, execute and interrupt
execution.py       one execute's outcome, gathered from its IOPub messages
connection_info.py a kernel's connection info and its channels' addresses
host_channels.py   the host's ends of shell, control and IOPub, connected and drained
channels.py        shell, control and IOPub, each read within a byte budget
zmtp.py            a strict ZMTP 3.0 peer that never holds more than its budget
output_capture.py  one call's output, bounded (head and tail, spill, images)
run_result.py      ExecutionResult: a run's outcome and what the session did about it
startup_hooks.py   files in a workspace that Python would run at start-up
kernel_factory.py  KernelFactory: where a session gets its kernels (a scripted one in tests)
"""
