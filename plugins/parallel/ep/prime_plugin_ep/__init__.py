"""prime-plugin-ep: Expert parallelism for MoE models, with a torch all-to-all backend."""
