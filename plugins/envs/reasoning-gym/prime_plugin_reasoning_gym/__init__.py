"""prime-plugin-reasoning-gym: the procedural datasets of reasoning-gym as RL environments."""
