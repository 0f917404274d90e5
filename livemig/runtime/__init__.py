"""A member's side of the protocol, in rooms named for what they do.

registry.py (what the user registered) is the bottom; loop.py (one step),
zero1_step.py, pull.py (state to and from peers), migration.py, standby.py
and self_faults.py are mixed into `livemig.api.Context`. Nothing here
imports livemig.api (tests/unit/test_layers.py checks it).
"""
