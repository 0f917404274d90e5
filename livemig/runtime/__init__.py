"""A member's side of the protocol, in rooms named for what they do.

registry.py (what the user registered) is the bottom; loop.py (one step) and pull.py
(state to and from peers) are mixed into `livemig.api.Engine`; strategies/ holds one
object per kind of parallelism that the step, the recovery and the migration ask;
migration.py, standby.py, self_faults.py, batches.py and the others are its collaborators;
member.py is the etcd side it is called back from (Callbacks).
Nothing here imports livemig.api (tests/unit/test_layers.py checks it).
"""
