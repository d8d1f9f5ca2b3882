"""Model quality evaluation: KL divergence of a student model from a teacher."""
