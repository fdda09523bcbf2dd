"""prime-plugin-slurm: Submits runs to SLURM: renders an sbatch script from a Jinja2 template."""
