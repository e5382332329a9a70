"""ZeRO stage 3: parameters sharded and gathered by module hooks (see optimizer.py)."""
