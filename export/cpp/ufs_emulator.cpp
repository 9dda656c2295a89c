// Load an exported UFS emulator and print its predictions and Jacobian, in physical units.
//
//   ufs_emulator MODEL INPUTS.csv [--format aoti|torchscript|soca|ufsnet] [--threads N]
//
// --format picks the artefact (default aoti):
//   aoti         an AOTInductor package (python -m toolkit.export aoti RUN_DIR --out emulator.pt2), run with
//                torch::inductor::AOTIModelPackageLoader: (predictions, Jacobian) in one call;
//   torchscript  aibalance's TorchScript layout (python -m toolkit.export torchscript RUN_DIR --out emulator.pt),
//                run with torch::jit::load and its methods predict and jac_physical (as aibalance's
//                ufsemulator/cpp/ufs_emulator.cpp loads it; names from its `meta` attribute);
//   soca         SOCA's layout (... torchscript RUN_DIR --out DIR/MODEL.pt --format soca), loaded as SOCA's
//                BaseEmul.h loads IceNet (icenet.h): torch::load(model, MODEL), model->loadNorm(MODEL)
//                (DIR/normalization.MODEL), then forward and jac one point at a time (float32), as IceEmul.h;
//                the inputs are SOCA's, tair tsfc sst sss hs hi sice, the output aice;
//   ufsnet       our MLP's layout (... --format ufsnet), loaded the same way into UfsNet (ufs_net.h).
//
// INPUTS.csv: one point per line, the input fields in the model's order (comma-separated; a first line that is not
// numeric is taken as a header and skipped). Output: a header with the output names and then, per output o and
// input i, d<o>_d<i> (e.g. daice_dsst: d aice / d sst, in aice's units per sst's units), then one line per point,
// values printed with 17 significant digits (float64 round trip). The input and output names come from the
// artefact's metadata. Errors: one line on stderr, exit 2.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "icenet.h"
#include "csv_inputs.h"
#include "ufs_net.h"

static std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// What every format gives: the names, and x [n, inputs] float64 -> (predictions [n, outputs], Jacobian
// [n, outputs, inputs]), physical units.
struct Emulator {
  std::vector<std::string> inputs, outputs;
  std::function<std::pair<torch::Tensor, torch::Tensor>(const torch::Tensor&)> run;
  std::shared_ptr<void> keep;  // what run uses
};

// A refusal of the artefact: its message becomes the one error line.
struct BadArtefact : std::runtime_error {
  using std::runtime_error::runtime_error;
};

static Emulator load_aoti(const std::string& path) {
  std::shared_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::unordered_map<std::string, std::string> metadata;
  try {
    loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(path);
    metadata = loader->get_metadata();
  } catch (const std::exception& error) {
    throw BadArtefact(path + " is not an AOTInductor package (python -m toolkit.export aoti writes one): " +
                      first_line(error.what()));
  }
  if (!metadata.count("inputs") || !metadata.count("outputs"))
    throw BadArtefact(path + " names no inputs/outputs in its metadata; export it with python -m toolkit.export aoti");
  Emulator emulator{split(metadata["inputs"], ','), split(metadata["outputs"], ','), nullptr, loader};
  emulator.run = [loader](const torch::Tensor& x) {
    auto results = loader->run({x});  // {predictions [n, outputs], jacobian [n, outputs, inputs]}
    return std::make_pair(results.at(0), results.at(1));
  };
  return emulator;
}

// The short names of aibalance's `meta` dict (input_short_names, output_short_names: export_to_torchscript.py:181-182)
static std::pair<std::vector<std::string>, std::vector<std::string>> short_names(const c10::IValue& meta,
                                                                                 const std::string& path) {
  std::unordered_map<std::string, std::string> entries;
  if (meta.isGenericDict())
    for (const auto& entry : meta.toGenericDict())
      entries[entry.key().toStringRef()] = entry.value().toStringRef();
  if (!entries.count("input_short_names") || !entries.count("output_short_names"))
    throw BadArtefact(path + " holds no meta input_short_names/output_short_names; export it with python -m "
                      "toolkit.export torchscript");
  return {split(entries["input_short_names"], ','), split(entries["output_short_names"], ',')};
}

static Emulator load_torchscript(const std::string& path) {
  auto module = std::make_shared<torch::jit::Module>();
  try {
    *module = torch::jit::load(path);  // aibalance's ufs_emulator.cpp:17
  } catch (const std::exception& error) {
    throw BadArtefact(path + " is not a TorchScript archive (python -m toolkit.export torchscript writes one): " +
                      first_line(error.what()));
  }
  if (!module->hasattr("meta") || !module->find_method("predict") || !module->find_method("jac_physical"))
    throw BadArtefact(path + " is not aibalance's layout (meta, predict, jac_physical); export it with python -m "
                      "toolkit.export torchscript");
  auto names = short_names(module->attr("meta"), path);
  module->eval();
  Emulator emulator{names.first, names.second, nullptr, module};
  emulator.run = [module](const torch::Tensor& x) {
    auto predictions = module->get_method("predict")({x}).toTensor();
    auto jacobian = module->get_method("jac_physical")({x}).toTensor();
    return std::make_pair(predictions, jacobian);
  };
  return emulator;
}

static Emulator load_soca(const std::string& path) {
  // BaseEmul.h takes the sizes from its YAML (ffnn.inputSize, ...); here they come from the file: fc1's weight is
  // [hidden, inputs], fc2's [outputs, hidden]
  int64_t inputs = 0, hidden = 0, outputs = 0;
  try {
    torch::serialize::InputArchive archive, first, second;
    torch::Tensor weight1, weight2;
    archive.load_from(path);
    archive.read("fc1", first);
    archive.read("fc2", second);
    first.read("weight", weight1);
    second.read("weight", weight2);
    hidden = weight1.size(0);
    inputs = weight1.size(1);
    outputs = weight2.size(0);
  } catch (const std::exception& error) {
    throw BadArtefact(path + " is not SOCA's layout written by python -m toolkit.export torchscript --format soca: " +
                      first_line(error.what()));
  }
  if (inputs != 7 || outputs != 1)
    throw BadArtefact(path + " maps " + std::to_string(inputs) + " inputs to " + std::to_string(outputs) +
                      " outputs; SOCA's IceNet maps 7 (tair tsfc sst sss hs hi sice) to 1 (aice)");
  auto model = std::make_shared<IceNet>(inputs, hidden, outputs, 1, 1);  // BaseEmul.h: make_shared<Net>(...)
  try {
    model->initWeights();
    torch::load(model, path);  // BaseEmul.h: torch::load(model_, modelFileName)
    model->loadNorm(path);     // BaseEmul.h: model_->loadNorm(modelFileName)
  } catch (const std::exception& error) {
    throw BadArtefact(path + " and " + UfsNet::normFileName(path) + " do not load as SOCA's IceNet: " +
                      first_line(error.what()));
  }
  Emulator emulator{{"tair", "tsfc", "sst", "sss", "hs", "hi", "sice"}, {"aice"}, nullptr, model};
  emulator.run = [model](const torch::Tensor& x) {  // IceEmul.h predict: one float32 point at a time
    auto predictions = torch::empty({x.size(0), 1}, torch::kFloat64);
    auto jacobian = torch::empty({x.size(0), 1, x.size(1)}, torch::kFloat64);
    torch::AutoGradMode enableGrad(true);  // jac's backward (the caller holds a NoGradGuard)
    torch::Tensor input = torch::ones({x.size(1)});
    for (int64_t p = 0; p < x.size(0); ++p) {
      input.copy_(x[p]);
      predictions[p][0] = model->forward(input).item<float>();
      jacobian[p][0].copy_(model->jac(input));
    }
    return std::make_pair(predictions, jacobian);
  };
  return emulator;
}

static Emulator load_ufsnet(const std::string& path) {
  // BaseEmul.h takes the sizes from its YAML (ffnn.inputSize, ...); here they come from the file: fc1's weight is
  // [hidden, inputs], output_mean is [outputs]
  int64_t inputs = 0, hidden = 0, outputs = 0;
  c10::IValue meta;
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    torch::serialize::InputArchive first;
    torch::Tensor weight, output_mean;
    archive.read("fc1", first);
    first.read("weight", weight);
    archive.read("output_mean", output_mean, /*is_buffer=*/true);
    hidden = weight.size(0);
    inputs = weight.size(1);
    outputs = output_mean.size(0);
    archive.read("meta", meta);
  } catch (const std::exception& error) {
    throw BadArtefact(path + " is not UfsNet's layout written by python -m toolkit.export torchscript --format "
                      "ufsnet: " + first_line(error.what()));
  }
  auto names = short_names(meta, path);
  auto model = std::make_shared<UfsNet>(inputs, hidden, outputs, 1, 1);  // BaseEmul.h: make_shared<Net>(...)
  try {
    model->initWeights();
    torch::load(model, path);  // BaseEmul.h: torch::load(model_, modelFileName)
    model->loadNorm(path);     // BaseEmul.h: model_->loadNorm(modelFileName)
  } catch (const std::exception& error) {
    throw BadArtefact(path + " and " + UfsNet::normFileName(path) + " do not load as UfsNet's layout: " +
                      first_line(error.what()));
  }
  model->eval();
  Emulator emulator{names.first, names.second, nullptr, model};
  emulator.run = [model](const torch::Tensor& x) { return std::make_pair(model->forward(x), model->jac(x)); };
  return emulator;
}

int main(int argc, char** argv) {
  const std::string usage =
      "usage: ufs_emulator MODEL INPUTS.csv [--format aoti|torchscript|soca|ufsnet] [--threads N]";
  std::vector<std::string> positional;
  std::string format = "aoti";
  for (int index = 1; index < argc; ++index) {
    std::string argument = argv[index];
    if (argument == "--format" || argument == "--threads") {
      if (index + 1 >= argc) return fail(argument + " needs a value; " + usage);
      std::string value = argv[++index];
      if (argument == "--format") {
        format = value;
      } else {
        char* end = nullptr;
        long threads = std::strtol(value.c_str(), &end, 10);
        if (*end != '\0' || threads < 1) return fail("--threads " + value + " is not a number >= 1; " + usage);
        torch::set_num_threads(static_cast<int>(threads));
      }
    } else if (argument.rfind("--", 0) == 0) {
      return fail("unknown option " + argument + "; " + usage);
    } else {
      positional.push_back(argument);
    }
  }
  if (positional.size() != 2) return fail(usage);
  const std::string model_path = positional[0], csv_path = positional[1];

  Emulator emulator;
  try {
    if (format == "aoti")
      emulator = load_aoti(model_path);
    else if (format == "torchscript")
      emulator = load_torchscript(model_path);
    else if (format == "soca")
      emulator = load_soca(model_path);
    else if (format == "ufsnet")
      emulator = load_ufsnet(model_path);
    else
      return fail("--format " + format + " is not aoti, torchscript, soca or ufsnet");
  } catch (const BadArtefact& error) {
    return fail(error.what());
  }
  const auto& input_names = emulator.inputs;
  const auto& output_names = emulator.outputs;

  std::vector<std::vector<double>> points;
  if (auto error = read_rows(csv_path, input_names.size(), "the model", points); !error.empty()) return fail(error);
  std::vector<double> values;
  for (const auto& point : points) values.insert(values.end(), point.begin(), point.end());
  const size_t rows = points.size();
  auto inputs = torch::from_blob(values.data(), {static_cast<long>(rows), static_cast<long>(input_names.size())},
                                 torch::kFloat64).clone();
  torch::NoGradGuard no_grad;  // the TorchScript and SOCA Jacobians switch grad mode on for themselves
  auto results = emulator.run(inputs);
  auto predictions = results.first.to(torch::kCPU, torch::kFloat64).contiguous();
  auto jacobian = results.second.to(torch::kCPU, torch::kFloat64).contiguous();

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
