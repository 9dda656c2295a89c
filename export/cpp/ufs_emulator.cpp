// Load an exported UFS emulator (an AOTInductor package: python -m toolkit.export aoti RUN_DIR --out emulator.pt2)
// and print its predictions and Jacobian, in physical units.
//
//   ufs_emulator MODEL.pt2 INPUTS.csv [--threads N]
//
// INPUTS.csv: one point per line, the input fields in the model's order (comma-separated; a first line that is not
// numeric is taken as a header and skipped). Output: a header with the output names and then, per output o and
// input i, d<o>_d<i> (e.g. daice_dsst: d aice / d sst, in aice's units per sst's units), then one line per point,
// values printed with 17 significant digits (float64 round trip). The input and output names come from the
// package's metadata. Errors: one line on stderr, exit 2.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
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

static std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream cells(text);
  std::string cell;
  while (std::getline(cells, cell, separator)) parts.push_back(cell);
  return parts;
}

static bool parse_row(const std::string& line, std::vector<double>& row) {
  row.clear();
  for (const auto& cell : split(line, ',')) {
    char* end = nullptr;
    double value = std::strtod(cell.c_str(), &end);
    if (end == cell.c_str()) return false;
    row.push_back(value);
  }
  return !row.empty();
}

static std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 5 && std::string(argv[3]) == "--threads"))
    return fail("usage: ufs_emulator MODEL.pt2 INPUTS.csv [--threads N]");
  if (argc == 5) torch::set_num_threads(std::atoi(argv[4]));

  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::unordered_map<std::string, std::string> metadata;
  try {
    loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(argv[1]);
    metadata = loader->get_metadata();
  } catch (const std::exception& error) {
    std::string why = error.what();
    return fail(std::string(argv[1]) + " is not an AOTInductor package (python -m toolkit.export aoti writes one): " +
                why.substr(0, why.find('\n')));
  }
  if (!metadata.count("inputs") || !metadata.count("outputs"))
    return fail(std::string(argv[1]) + " names no inputs/outputs in its metadata; export it with python -m "
                "toolkit.export aoti");
  auto input_names = split(metadata["inputs"], ',');
  auto output_names = split(metadata["outputs"], ',');

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
  if (rows == 0) return fail(std::string(argv[2]) + " holds no input rows");
  auto inputs = torch::from_blob(values.data(), {static_cast<long>(rows), static_cast<long>(input_names.size())},
                                 torch::kFloat64).clone();
  torch::NoGradGuard no_grad;
  auto results = loader->run({inputs});  // {predictions [n, outputs], jacobian [n, outputs, inputs]}
  auto predictions = results.at(0).to(torch::kCPU, torch::kFloat64).contiguous();
  auto jacobian = results.at(1).to(torch::kCPU, torch::kFloat64).contiguous();

  std::string header;
  for (const auto& name : output_names) header += (header.empty() ? "" : ",") + name;
  for (const auto& output : output_names)
    for (const auto& input : input_names) header += ",d" + output + "_d" + input;
  std::cout << header << "\n";
  auto out = predictions.accessor<double, 2>();
  auto jac = jacobian.accessor<double, 3>();
  for (long p = 0; p < out.size(0); ++p) {
    std::string text;
    for (long o = 0; o < out.size(1); ++o) text += (o ? "," : "") + number(out[p][o]);
    for (long o = 0; o < jac.size(1); ++o)
      for (long i = 0; i < jac.size(2); ++i) text += "," + number(jac[p][o][i]);
    std::cout << text << "\n";
  }
  return 0;
}
