"""What the two sides compile and compute, compared: programs, memory, activation constraints, the localizer."""
