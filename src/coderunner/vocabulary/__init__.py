"""The vocabulary floor: the value types every layer shares and that cross process boundaries as they are.

Nothing here imports anything of coderunner's, so config, sandbox, hostfs and egress can all stand on it
without standing on each other (pyproject's import contract keeps it the bottom layer).

    network.py   NetworkMode, the order the user's ceiling ranks modes in, and how a refusal words the
                 way to more network (within the ceiling)
"""
