"""The attention-dynamics experiments after Snell et al.: how attention is learned
(copy, relevance, ktiw, ibm1, multihead) and their training loops."""
