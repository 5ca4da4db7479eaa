// llama.cpp's tokenizer over JSON lines, for bench/tokenizer_reference.py.
//
//   tokenizer_probe VOCAB.gguf < requests.jsonl > answers.jsonl
//
// Each request is one JSON object a line, answered by one line:
//   {"text": "...", "add_special": false, "parse_special": true}  ->  {"ids": [...]}
//   {"ids": [...], "remove_special": false, "unparse_special": true}  ->  {"hex": "<detokenized bytes>"}
// The vocabulary is loaded once (vocab_only), as llama-tokenize loads it.
#include "llama.h"
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;

static std::string to_hex(const std::string & s) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    out.reserve(s.size() * 2);
    for (unsigned char c : s) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s VOCAB.gguf < requests.jsonl\n", argv[0]);
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string line;
    while (std::getline(std::cin, line)) {
        json req = json::parse(line);
        json ans;
        if (req.contains("text")) {
            const std::string text = req["text"].get<std::string>();
            const bool add_special = req.value("add_special", false);
            const bool parse_special = req.value("parse_special", true);
            std::vector<llama_token> ids(text.size() + 8);
            int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, parse_special);
            if (n < 0) {
                ids.resize(-n);
                n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), add_special, parse_special);
            }
            ids.resize(n);
            ans["ids"] = ids;
        } else {
            const std::vector<llama_token> ids = req["ids"].get<std::vector<llama_token>>();
            const bool remove_special = req.value("remove_special", false);
            const bool unparse_special = req.value("unparse_special", true);
            std::string text(ids.size() * 8 + 16, '\0');
            int n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), remove_special, unparse_special);
            if (n < 0) {
                text.resize(-n);
                n = llama_detokenize(vocab, ids.data(), (int) ids.size(), text.data(), (int) text.size(), remove_special, unparse_special);
            }
            text.resize(n);
            ans["hex"] = to_hex(text);
        }
        std::cout << ans.dump() << "\n";
    }
    llama_model_free(model);
    return 0;
}
