def mean_word_length(text):
    words = text.split()
    return sum(map(len, words)) / len(words) if words else 0.0
