"""The node agent: one per node. Registers the node, sends heartbeats, and
carries out the scheduler's decisions for this node through an executor."""
