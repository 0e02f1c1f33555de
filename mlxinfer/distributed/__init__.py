"""One model over several machines (or processes): pipeline or tensor parallel on `mx.distributed`.

`mlxinfer serve MODEL --hostfile hosts.json` starts the ranks (launch.py), each loads
its part (cluster.py), and rank 0 serves while the others replay its turns (replay.py).
`mlxinfer plan MODEL --hosts ...` shows a split before anything runs (split.py, estimate.py).
"""

from .cluster import Launch
from .hosts import Host, read_hostfile
from .leader import Cluster
from .leader import start as start_cluster

__all__ = ["Cluster", "Host", "Launch", "read_hostfile", "start_cluster"]
