"""Membership: workers register themselves in etcd, front ends watch who is there.

  etcd_wire ◆     etcd's v3 JSON gateway as data: bodies, answers, watch lines
  etcd            the httpx client (leases, keys, prefix watch) under Trio
  records ◆       what a worker publishes, its key, and the membership a watch builds
  registration    a worker's lease, key and keepalive; the drain on SIGTERM
  watch           a front end's view of the members, kept by a prefix watch
  interfaces      which network interface carries an address (UCX confinement)
  embedded ◆      the command line of a single-member etcd (`up`, tests)

◆: pure (no trio, httpx, torch).
"""
