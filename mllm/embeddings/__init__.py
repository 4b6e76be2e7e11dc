"""The word-embedding family: word2vec's CBOW, trained on the contexts inside each paragraph.

Its modules: `cbow` (the model and its paragraph-bound batches), `wordsim` (WordSim-353,
SimLex-999 and the Google analogies read from gensim's installed wheel, nearest neighbours,
exports), `evaluation` (a checkpoint's scores, exports and PCA picture). Headline: WordSim-353
Spearman of the input embedding (higher is better); a sample is a word's nearest neighbours.
"""
