"""etcd rendezvous: the single source of truth for who is in a job.

- keys.py       the key schema (nothing else builds key strings)
- client.py     thin pyetcd wrapper: endpoints, failover, one-line errors
- lease.py      leases with keep-alive threads and loss reporting
- membership.py generation CAS, member table, fencing
- election.py   coordinator leader election
- watch.py      watches that resume from the last seen revision
- embedded.py   a local etcd server (or 3-member cluster) for runs and tests
"""
