"""Quality measures (class accuracy, Frechet distance) for generated demo images."""
