"""Code that runs inside Ray actors (the dataset worker, its pool) and the conversion of what they return."""
