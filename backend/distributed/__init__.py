"""One model split across processes: the group's collectives (group.py), rank 0's worker processes and the step
plan they follow (workers.py), and a worker's main (worker.py). How the weights split is models/sharding.py."""
