"""Multi-node recipes: sbatch scripts and a simulated two-host cluster for the tests."""
