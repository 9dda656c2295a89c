// Load an exported UFS emulator (TorchScript, physical units in and out) and print its predictions.
//
//   ufs_emulator MODEL.pt INPUTS.csv [--threads N]
//
// INPUTS.csv: one pattern per line, the input fields in the model's order (comma-separated; a first line that is
// not numeric is taken as a header and skipped). Output: a header with the output names, then one line per
// pattern, values printed with 17 significant digits (float64 round trip). Errors: one line on stderr, exit 2.
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static int fail(const std::string& message) {
  std::cerr << "error: " << message << std::endl;
  return 2;
}

static bool parse_row(const std::string& line, std::vector<double>& row) {
  row.clear();
  std::stringstream cells(line);
  std::string cell;
  while (std::getline(cells, cell, ',')) {
    char* end = nullptr;
    double value = std::strtod(cell.c_str(), &end);
    if (end == cell.c_str()) return false;
    row.push_back(value);
  }
  return !row.empty();
}

int main(int argc, char** argv) {
  if (argc < 3) return fail("usage: ufs_emulator MODEL.pt INPUTS.csv [--threads N]");
  if (argc == 5 && std::string(argv[3]) == "--threads") torch::set_num_threads(std::atoi(argv[4]));

  torch::jit::script::Module module;
  try {
    module = torch::jit::load(argv[1]);
  } catch (const c10::Error& error) {
    return fail(std::string(argv[1]) + " is not a TorchScript module: " + error.what_without_backtrace());
  }
  module.eval();
  auto input_names = module.attr("input_names").toListRef();
  auto output_names = module.attr("output_names").toListRef();

  std::ifstream csv(argv[2]);
  if (!csv) return fail(std::string(argv[2]) + " cannot be read");
  std::vector<double> values, row;
  std::string line;
  size_t rows = 0, line_number = 0;
  while (std::getline(csv, line)) {
    ++line_number;
    if (line.empty()) continue;
    if (!parse_row(line, row)) {
      if (line_number == 1) continue;  // a header
      return fail(std::string(argv[2]) + " line " + std::to_string(line_number) + " is not numeric");
    }
    if (row.size() != input_names.size())
      return fail(std::string(argv[2]) + " line " + std::to_string(line_number) + " has " +
                  std::to_string(row.size()) + " values; the model takes " + std::to_string(input_names.size()));
    values.insert(values.end(), row.begin(), row.end());
    ++rows;
  }
  auto inputs = torch::from_blob(values.data(), {static_cast<long>(rows), static_cast<long>(input_names.size())},
                                 torch::kFloat64).clone();
  torch::NoGradGuard no_grad;
  auto outputs = module.forward({inputs}).toTensor().to(torch::kFloat64).contiguous();

  for (size_t k = 0; k < output_names.size(); ++k) std::cout << (k ? "," : "") << output_names[k].toStringRef();
  std::cout << "\n";
  auto out = outputs.accessor<double, 2>();
  for (long i = 0; i < out.size(0); ++i) {
    for (long k = 0; k < out.size(1); ++k) {
      char text[32];
      std::snprintf(text, sizeof text, "%.17g", out[i][k]);
      std::cout << (k ? "," : "") << text;
    }
    std::cout << "\n";
  }
  return 0;
}
