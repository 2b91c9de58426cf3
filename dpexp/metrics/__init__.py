"""Task metrics: accuracy, and the generation metrics of the E2E challenge (BLEU, ROUGE-L, ...). Imports:
torch and the metric packages only."""
