"""Process groups and collectives for tensor and pipeline parallel replicas."""
