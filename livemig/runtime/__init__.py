"""A member's side of the protocol, in rooms named for what they do.

registry.py (what the user registered) is the bottom; loop.py (one step),
zero1_step.py, pull.py (state to and from peers), migration.py and standby.py
are mixed into `livemig.api.Engine`; self_faults.py and batches.py are its
collaborators; member.py is the etcd side it is called back from (Callbacks).
Nothing here imports livemig.api (tests/unit/test_layers.py checks it).
"""
