"""What a run is built from, once, before its first round: device and precision policy, data and partition,
architecture groups, the task calendar, the public stream and the preflight checks."""
