"""The round loop: client sampling, seeding, checkpoints, metrics; engines that run methods."""
