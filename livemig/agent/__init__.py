"""The per-node supervisor behind `livemig run` (and the helpers `livemig-spare start` shares):
start and watch the processes of a node, carry out fault plans, write the report."""
